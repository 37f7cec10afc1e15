"""What the training steps (02_singlegpu to 05_lora) share, one idea per module: data, chess
notation and evaluation, arguments, checkpoints, metrics, the run directory.

Everything that teaches parallelism stays in the step scripts themselves. Launching lives in
`launch/`, tools that serve several steps in `tools/`; nothing here imports either.
"""
