"""Hyperparameter search with Determined's searchers: search spaces (`space`), adaptive ASHA's brackets, rungs
and stop rule (`asha`), the searcher section of a search (`spec`) and `dtrain preview` (`preview`). Running the
trials is not built yet (docs/search.md). Nothing is imported here, so `dtrain --help` stays quick."""
