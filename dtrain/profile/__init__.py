"""Where the time goes: step-phase timers, the Chrome-trace timeline, and `dtrain diagnose`."""

from dtrain.profile.profiler import Profiler, tensorboard_scalars
from dtrain.profile.timeline import TIMELINE_TEMPLATE, Timeline
from dtrain.profile.timers import PHASES, StepTimer

__all__ = ["PHASES", "TIMELINE_TEMPLATE", "Profiler", "StepTimer", "Timeline", "tensorboard_scalars"]
