"""The rulebook: every validity rule of a layout, one named function each, returning the problems it finds.

The search, `evaluate`, plan files, the exports and the runtime call these same functions; none of them
imports the search or OR-Tools, so `import runtime` reads them without loading either.

* `layout`: a layout on a model and a device count (degrees, heads, experts, batch, schedule, split);
* `stack`: what a software stack runs (axes, ZeRO stages, schedules, recomputation, FP8 recipes), and
  the pins it leaves the search;
* `device`: what the device must have for the precision and the stack (refusals before a search);
* `plan_file`: a plan file's records against each other (a hand-edited file is checked before export);
* `runtime`: the layout against the ranks of the job that runs it.
"""
