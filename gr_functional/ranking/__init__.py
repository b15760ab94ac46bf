"""The ranking side (issue [kuairand]): generative-recommenders' dlrm_v3 HSTU ranking model,
reimplemented as pure functions over jagged arrays (docs/design/dlrm_v3_ranking_spec.md is the
specification, with GR's file and line for each rule): the STU layer (``stu``), the position and
time encodings (``encoding``), the input tokens (``tokens``: contextual slots, content and action
towers, the action bitmask encoder, jagged assembly), the output side (``heads``: timestamp
postprocessor, multitask head, per-task BCE) and the joined model with its host-side batch
builder and per-task AUC / GAUC / NE evaluation (``model``). Checked against GR's own
``DlrmHSTU`` (forward, losses and every gradient) by the developer tool
``tools/gr_ranking_crosscheck.py``. Training through ``grf train`` (``model.task = "ranking"``):
``data`` (datasets, split, loader), ``runner`` (step, evaluation, loop), ``sparse`` (hash tables)."""
