"""The trainer's own modules: the build phase that returns one `Run`, the loop that holds it.

Nothing here is imported by the component packages, except `train.callbacks` (the torch-free
callback contract that monitors and the config implement) and `train.config` (the `training:`
section). Kept light: `meshforge.config` imports those two without torch.
"""
