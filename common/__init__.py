"""What the three training steps share: data, chess evaluation, metrics, arguments.

Everything that teaches parallelism stays in the step scripts themselves; this package
holds only what is identical in 02_singlegpu, 03_ddp and 04_fsdp.
"""
