"""`dtrain diagnose`'s machinery: the short trials it runs (`trials`), what their phase profiles say
(`analysis`) and the chart of them (`chart`). The command itself is dtrain.commands.diagnose."""
