"""Where the time goes, as the Trainer records it: step-phase timers, the Chrome-trace timeline, the profiler."""

from dtrain.profile.profiler import Profiler, tensorboard_scalars
from dtrain.profile.timeline import TIMELINE_TEMPLATE, Timeline
from dtrain.profile.timers import PHASES, StepTimer

__all__ = ["PHASES", "TIMELINE_TEMPLATE", "Profiler", "StepTimer", "Timeline", "tensorboard_scalars"]
