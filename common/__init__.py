"""What the training steps (02_singlegpu to 06_tp) share, one idea per module: data, chess
notation and evaluation, arguments, checkpoints, metrics, the run directory.

Everything that teaches parallelism stays in the step scripts themselves. Launching lives in
`launch/`, tools that serve several steps in `tools/`; nothing here imports either.
"""
import logging

# torchao (QLoRA's 4-bit weights, common/nf4.py) is imported by transformers and peft whenever it is
# installed. On a CPU build of PyTorch it warns that its CUDA extensions do not load, and torch that two
# of its enums use a deprecated registration: four lines on every run, about nothing NF4 weights use.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
