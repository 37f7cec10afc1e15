"""How jobs start: torchrun with one-line errors (`launch.torchrun`), the step scripts as modules
(`launch.steps`, the only place that imports a script by path) and submit.py's submitit side
(`launch.step_launcher`). The steps themselves never import this package."""
