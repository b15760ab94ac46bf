"""The ranking side (issue [kuairand]): generative-recommenders' dlrm_v3 HSTU ranking model,
reimplemented as pure functions over jagged arrays (docs/dlrm_v3_ranking_spec.md is the
specification, with GR's file and line for each rule). Built so far: the STU layer (``stu``),
the position and time encodings (``encoding``), the input tokens (``tokens``: contextual slots,
content and action towers, the action bitmask encoder, jagged assembly), the output side
(``heads``: timestamp postprocessor, multitask head, per-task BCE; the item tower is a
``tokens.tower``). Not yet: the batch builder and the model that joins them, and the check
against GR's own code."""
