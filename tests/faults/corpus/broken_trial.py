"""A Trial file whose import fails (bad-input corpus): the error must be one line, not a traceback."""

import dtrain

raise ImportError("this model file needs a package that is not installed")


class BrokenTrial(dtrain.Trial):  # never reached
    pass
