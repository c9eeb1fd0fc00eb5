"""The one set of field validators (flame_llm/validate.py): every error names the field and its limit, carries
`.field`, and raises the caller's error class; and the defaults and ranges that two modules used to disagree on
are one now."""
import dataclasses

import pytest

from actors.engine_actor import ShardOptions
from flame_llm.config import EngineConfig, engine_config_from_json, engine_fields_from_json
from flame_llm.protocol.wire import encode_results
from flame_llm.sampling_params import SamplingParams, SamplingParamsError
from flame_llm.serving.http_app import HttpConfig
from flame_llm.serving.service_config import ClientConfig, RayConfig, ServiceConfig, config_from_dict
from flame_llm.validate import (
    FieldError,
    brief,
    check,
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_str,
    is_int,
    is_number,
)
from router.policy import RouterConfig


@pytest.mark.parametrize("call, words", [
    (lambda: check_int("n", 0, 1), "field 'n' must be an integer >= 1; got 0"),
    (lambda: check_int("n", 9, high=8), "field 'n' must be an integer <= 8; got 9"),
    (lambda: check_int("n", 9, 1, 8), "field 'n' must be an integer in [1, 8]; got 9"),
    (lambda: check_int("n", True, 0, 8), "field 'n' must be an integer in [0, 8]; got True"),
    (lambda: check_int("n", 2.0, 1), "field 'n' must be an integer >= 1; got 2.0"),
    (lambda: check_int("n", "3"), "field 'n' must be an integer; got '3'"),
    (lambda: check_int("n", 0, 1, optional=True), "field 'n' must be null or an integer >= 1; got 0"),
    (lambda: check_int("n", -2, 1, limit="-1 or an integer >= 1"), "field 'n' must be -1 or an integer >= 1; got -2"),
    (lambda: check_number("x", -0.5, 0), "field 'x' must be a number >= 0; got -0.5"),
    (lambda: check_number("x", 0, 0, low_open=True), "field 'x' must be a number > 0; got 0"),
    (lambda: check_number("x", 0.0, 0, 1, low_open=True), "field 'x' must be a number in (0, 1]; got 0.0"),
    (lambda: check_number("x", 11, 0, 10), "field 'x' must be a number in [0, 10]; got 11"),
    (lambda: check_number("x", float("nan")), "field 'x' must be a number; got nan"),
    (lambda: check_number("x", float("inf"), 0), "field 'x' must be a number >= 0; got inf"),
    (lambda: check_number("x", False, 0), "field 'x' must be a number >= 0; got False"),
    (lambda: check_number("x", "1", optional=True), "field 'x' must be null or a number; got '1'"),
    (lambda: check_choice("p", "x", ("a", "b")), "field 'p' must be one of 'a', 'b'; got 'x'"),
    (lambda: check_choice("p", ["a"], {"a", "b"}), "field 'p' must be one of"),
    (lambda: check_bool("b", 1), "field 'b' must be true or false; got 1"),
    (lambda: check_bool("b", "yes", optional=True), "field 'b' must be null or true or false; got 'yes'"),
    (lambda: check_str("s", ""), "field 's' must be a non-empty string; got ''"),
    (lambda: check_str("s", 5, empty=True), "field 's' must be a string; got 5"),
    (lambda: check_str("s", 5, optional=True, what="a host"), "field 's' must be null or a non-empty host; got 5"),
    (lambda: check(False, "c", "a riddle", 3), "field 'c' must be a riddle; got 3"),
    (lambda: check_int("n", 2**2000, 1, 8), "field 'n' must be an integer in [1, 8]; got <int of 2001 bits>"),
    (lambda: check_int("n", 0, 1, where="router field"), "router field 'n' must be an integer >= 1; got 0"),
])
def test_each_validator_names_the_field_and_the_limit(call, words):
    with pytest.raises(FieldError) as e:
        call()
    assert words in str(e.value)
    assert isinstance(e.value, ValueError) and str(e.value).split("'")[1] == e.value.field


def test_values_within_the_limits_pass():
    check_int("n", 1, 1, 1)
    check_int("n", None, 1, optional=True)
    check_number("x", 1, 0, 1, low_open=True)
    check_number("x", 2**70, 0)  # an int too large for a float is still a finite number
    check_choice("p", "a", ("a",))
    check_bool("b", None, optional=True)
    check_str("s", "", empty=True)
    assert is_int(3) and not is_int(True) and not is_int(3.0)
    assert is_number(3.5) and not is_number(float("inf")) and not is_number(True) and not is_number("3")


def test_the_callers_error_class_carries_the_field():
    with pytest.raises(SamplingParamsError) as e:
        check_int("max_tokens", 0, 1, where="sampling parameter", error=SamplingParamsError)
    assert e.value.field == "max_tokens" and isinstance(e.value, FieldError)
    with pytest.raises(SamplingParamsError, match="sampling parameter 'top_p' must be in \\(0, 1\\]") as e:
        SamplingParams(top_p=0)
    assert e.value.field == "top_p"
    with pytest.raises(FieldError, match="http field 'port' must be an integer in \\[0, 65535\\]") as e:
        HttpConfig(port=-1)
    assert e.value.field == "port"


@pytest.mark.parametrize("make, words", [
    (lambda: ShardOptions(max_payload_bytes=10), "shard field 'max_payload_bytes' must be an integer in [1024, "),
    (lambda: RouterConfig(max_entries=0), "router field 'max_entries' must be an integer >= 1; got 0"),
    (lambda: ClientConfig(max_retries=-1), "client field 'max_retries' must be an integer >= 0; got -1"),
    (lambda: RayConfig(num_cpus=0), "ray field 'num_cpus' must be null or an integer >= 1; got 0"),
    (lambda: HttpConfig(host=""), "http field 'host' must be a non-empty host name or address; got ''"),
    (lambda: EngineConfig.from_kwargs(max_num_seqs=0), "engine field 'max_num_seqs' must be an integer >= 1; got 0"),
    (lambda: EngineConfig.from_kwargs(gpu_memory_utilization=0), "engine field 'gpu_memory_utilization' must be a "
                                                                 "number in (0, 1]; got 0"),
    (lambda: EngineConfig.from_kwargs(speculative_max_batch_size=-1), "engine field 'speculative_max_batch_size' "
                                                                      "must be an integer >= 0 (0: never speculate)"),
    (lambda: EngineConfig.from_kwargs(eos_token_ids=[1, -1]), "engine field 'eos_token_ids' must be a list of token "
                                                              "ids"),
])
def test_every_config_type_says_section_field_and_limit(make, words):
    with pytest.raises(ValueError) as e:
        make()
    assert words in str(e.value)


# --- the disagreements that are one rule now (each failed before) ---

@pytest.mark.parametrize("level", [-8, -7, -3, 0, 1, 19, 20])
def test_one_zstd_level_range_for_the_shard_option_and_the_wire(level):
    """ShardOptions refused levels [-7, 0] that the wire's codec takes: the shard section now uses the codec's
    range, so a level is accepted by both or refused by both."""
    try:
        encode_results([], level)
        wire_ok = True
    except ValueError:
        wire_ok = False
    try:
        ShardOptions(zstd_level=level)
        shard_ok = True
    except ValueError:
        shard_ok = False
    assert shard_ok == wire_ok and wire_ok == (-7 <= level <= 19)


def test_load_format_is_set_in_one_place():
    """The service had its own load_format (with its own default and check) next to the engine's."""
    assert "load_format" not in {f.name for f in dataclasses.fields(ServiceConfig)}
    cfg = ServiceConfig.from_kwargs(load_format="dummy")
    assert cfg.engine.model_config.load_format == "dummy" and cfg.engine_kwargs() == {"load_format": "dummy"}
    assert ServiceConfig().engine_kwargs() == {}  # no default is repeated outside the engine's config


def test_the_engine_section_is_checked_when_the_config_is_read():
    """An engine value out of range was found only when a shard built its engine; the section is the engine's own
    config type now, read and checked once."""
    with pytest.raises(ValueError, match="x.yaml: engine field 'max_num_seqs' must be an integer >= 1; got 0"):
        config_from_dict({"engine": {"max_num_seqs": 0}}, "x.yaml")
    assert isinstance(ServiceConfig().engine, EngineConfig)


def test_engine_json_is_parsed_into_the_same_engine_config():
    """--engine-json checked names only; its values now go through the EngineConfig the YAML's section is."""
    with pytest.raises(ValueError, match="--x: engine field 'block_size' must be a positive multiple of 16; got 24"):
        engine_fields_from_json('{"block_size": 24}', "--x")
    assert engine_fields_from_json('{"max_num_seqs": 8, "eos_token_ids": [2]}') == {"max_num_seqs": 8,
                                                                                      "eos_token_ids": (2,)}
    cfg = engine_config_from_json('{"max_num_seqs": 8, "load_format": "dummy"}')
    assert cfg == EngineConfig.from_kwargs(max_num_seqs=8, load_format="dummy")
    assert config_from_dict({"engine": {"max_num_seqs": 8, "load_format": "dummy"}}).engine == cfg


@pytest.mark.parametrize("make", [
    lambda: RouterConfig(spill_factor=float("inf")),
    lambda: HttpConfig(header_timeout_s=float("inf")),
    lambda: ClientConfig(restart_timeout_s=float("inf")),
    lambda: EngineConfig.from_kwargs(cpu_kvcache_gib=float("inf")),
])
def test_a_number_is_finite_everywhere(make):
    """Sampling refused inf while the configs took it where no upper bound applied: 'a number' is finite in all."""
    with pytest.raises(ValueError, match="must be a number"):
        make()


def test_engine_flags_are_booleans():
    """A YAML 'yes' (a string) for an engine flag was truthy; flags take true or false only."""
    with pytest.raises(ValueError, match="engine field 'enable_chunked_prefill' must be true or false; got 'yes'"):
        EngineConfig.from_kwargs(enable_chunked_prefill="yes")


def test_brief_is_bounded():
    assert brief(list(range(100))).endswith("... (100 in all)]")
    assert len(brief("x" * 10_000)) <= 80


def test_service_config_from_kwargs_passes_an_engine_config_through():
    engine = EngineConfig.from_kwargs(max_num_seqs=8, load_format="dummy")
    cfg = ServiceConfig.from_kwargs(model="m", engine=engine, num_shards=2)
    assert cfg.engine is engine and cfg.engine_kwargs() == {"max_num_seqs": 8, "load_format": "dummy"}
    assert cfg.placement.num_shards == 2
    with pytest.raises(ValueError, match=r"\['max_num_seqs'\] are given beside an EngineConfig"):
        ServiceConfig.from_kwargs(engine=engine, max_num_seqs=4)


@pytest.mark.parametrize("section, field", [("client", "flush_formed"), ("shard", "fair_admission")])
def test_an_unknown_field_is_refused_naming_it(section, field):
    """A config that sets a field no section has (here: switches issue 38 retired) is told its name: in a YAML
    section, as flat keywords, as a client override."""
    with pytest.raises(ValueError, match=f"unknown field\\(s\\) \\['{field}'\\] in section '{section}'"):
        config_from_dict({section: {field: True}}, source="svc.yaml")
    with pytest.raises(ValueError, match=f"unknown service config field '{field}'"):
        ServiceConfig.from_kwargs(**{field: True})
    if section == "client":
        from flame_llm.serving.client import make_client

        with pytest.raises(TypeError, match=field):
            make_client(ServiceConfig(), None, {}, **{field: True})
