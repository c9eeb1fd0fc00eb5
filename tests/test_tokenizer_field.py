"""The `tokenizer` field (engine and service config, --tokenizer on serve and serve-http): one loader for every
caller, the embedded tiny BPE or an HF tokenizer directory beside a model without one, and a clear error when the
model's vocabulary does not cover it."""
import os
import shutil

import pytest

from flame_llm import LLM, SamplingParams
from flame_llm.cli import build_parser
from flame_llm.cli_serve import config_of
from flame_llm.config import Config, EngineConfig
from flame_llm.models.tiny import TINY_VOCAB_SIZE, ensure_tiny_default, make_tiny_model
from flame_llm.models.tokenizer import has_tokenizer, load_tokenizer, tokenizer_dir
from flame_llm.serving.http_server import engine_fields
from flame_llm.serving.service import start_service
from flame_llm.serving.service_config import ServiceConfig, config_from_dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_8B = os.path.join(REPO, "configs", "models", "llama-3.1-8b")


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory) -> str:
    """A tiny checkpoint without a tokenizer (as the dummy-weight configs have none)."""
    return make_tiny_model(str(tmp_path_factory.mktemp("bare") / "m"), "llama", vocab_size=TINY_VOCAB_SIZE)


def test_tiny_tokenizer_is_built_once_and_loaded_by_name():
    tok = load_tokenizer("/nonexistent-model", "tiny", TINY_VOCAB_SIZE)
    assert len(tok) == TINY_VOCAB_SIZE and has_tokenizer(tokenizer_dir("", "tiny"))
    assert tok.decode(tok.encode("the keeper")) == "the keeper"


def test_a_larger_tokenizer_than_the_vocabulary_names_the_field_and_both_sizes():
    with pytest.raises(ValueError, match=r"'tokenizer' .* has 512 tokens, more than the model's vocab_size \(300\)"):
        load_tokenizer("/nonexistent-model", "tiny", 300)


def test_unset_tokenizer_is_the_model_directorys(bare_model, tmp_path):
    assert load_tokenizer(bare_model, required=False) is None
    with pytest.raises(ValueError, match="has no usable tokenizer.*set 'tokenizer'"):
        load_tokenizer(bare_model)
    assert len(load_tokenizer(ensure_tiny_default(), "", TINY_VOCAB_SIZE)) == TINY_VOCAB_SIZE  # it has one
    with pytest.raises(ValueError, match=r"field 'tokenizer' must be an HF tokenizer directory or 'tiny'; '.*empty'"):
        load_tokenizer(bare_model, str(tmp_path / "empty"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="field 'tokenizer' .*broken' cannot be loaded"):
        load_tokenizer(bare_model, str(broken))


def test_engine_serves_text_with_a_given_tokenizer(bare_model):
    with pytest.raises(ValueError, match="no usable tokenizer"):
        LLM(bare_model, max_model_len=64).generate(["hello"], SamplingParams(max_tokens=2))
    llm = LLM(bare_model, max_model_len=64, tokenizer="tiny")
    out = llm.generate(["The keeper"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 4 and isinstance(out.text, str)


def test_engine_field_is_checked_and_the_8b_dummy_config_takes_a_tokenizer():
    with pytest.raises(ValueError, match="engine field 'tokenizer' must be an HF tokenizer directory or 'tiny'"):
        EngineConfig.from_kwargs(tokenizer=3)
    cfg = Config.from_kwargs(LLAMA_8B, load_format="dummy", tokenizer="tiny")
    mc = cfg.model_config
    assert mc.tokenizer == "tiny" and len(load_tokenizer(mc.model, mc.tokenizer, mc.hf_config.vocab_size)) == 512


def test_service_config_top_level_tokenizer():
    cfg = config_from_dict({"model": "tiny", "tokenizer": "tiny"})
    assert cfg.tokenizer == "tiny" and cfg.engine_kwargs() == {"tokenizer": "tiny"}
    assert ServiceConfig().engine_kwargs() == {}  # unset: the engines' default, as before
    assert ServiceConfig.from_kwargs(tokenizer="tiny", max_num_seqs=4).engine_kwargs() == {"tokenizer": "tiny",
                                                                                          "max_num_seqs": 4}
    with pytest.raises(ValueError, match="unknown field.*'tokenizer'.*section 'engine'"):
        config_from_dict({"engine": {"tokenizer": "tiny"}})  # one place: the top level, beside the model
    with pytest.raises(ValueError, match="service config field 'tokenizer'"):
        config_from_dict({"tokenizer": 5})


def test_service_start_rejects_an_uncovered_tokenizer_before_ray(tmp_path):
    small = make_tiny_model(str(tmp_path / "small"), "llama", vocab_size=300)
    cfg = ServiceConfig.from_kwargs(model=small, tokenizer="tiny", num_shards=1)
    with pytest.raises(ValueError, match=r"has 512 tokens, more than the model's vocab_size \(300\)"):
        start_service(cfg)


def test_tokenizer_flags(tmp_path):
    parser = build_parser()
    args = parser.parse_args(["serve-http", "--model", "tiny", "--tokenizer", "tiny", "--engine-json",
                              '{"max_num_seqs": 4}'])
    assert engine_fields(args) == {"load_format": "auto", "tokenizer": "tiny", "max_num_seqs": 4}
    assert "tokenizer" not in engine_fields(parser.parse_args(["serve-http", "--model", "tiny"]))
    args = parser.parse_args(["serve", "--tokenizer", str(tmp_path)])
    assert config_of(args).tokenizer == str(tmp_path)
    assert config_of(parser.parse_args(["serve"])).tokenizer == ""


def test_a_copied_hf_tokenizer_directory_serves_the_bare_model(bare_model, tmp_path):
    tok_dir = tmp_path / "tok"
    shutil.copytree(tokenizer_dir("", "tiny"), tok_dir)
    llm = LLM(bare_model, max_model_len=64, tokenizer=str(tok_dir))
    assert llm.generate(["hi"], SamplingParams(max_tokens=2, ignore_eos=True))[0].text is not None
