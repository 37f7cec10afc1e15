"""Tools that serve several steps, importable and runnable (`python tools/check_plan.py ...`): the
memory plan check on fake tensors, the memory formulas, the loading measurement and the export of
a checkpoint to a Hugging Face folder."""
