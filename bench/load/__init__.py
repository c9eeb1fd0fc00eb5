"""Sustained load (`flame-llm bench --mode load`): the Poisson document-QA stream, its workloads, the load report,
long gaps, overload, and the scheduler-feature scenarios."""
