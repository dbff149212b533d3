"""Option choices shared by the engine, the command line and the analysis (no torch here,
so `depthdiag --help` can list them without importing it)."""

ISOLATE_CHOICES = ("counterfactual", "linear", "none")
"""How the diagnostic isolates the batch's effect: Delta(g) - Delta(0), the first-order term, or Delta(g)."""
RMS_MATCH_CHOICES = ("reference", "geomean", "per-tensor", "none")
"""How the compared updates are scaled to a common RMS."""
PRECISION_CHOICES = ("fp32", "bf16")
"""Training precision: fp32, or bf16 autocast."""
EVAL_SET_CHOICES = ("auto", "snapshot", "attributes")
"""The evaluation set `depthdiag diagnose` scores (see diag/run.py)."""
DEVICE_CHOICES = ("auto", "cpu", "cuda")
"""Where a command runs: 'auto' (cuda when available, else cpu), 'cpu' or 'cuda'."""
INTERVAL_METHOD_CHOICES = ("t", "bca")
"""How a confidence interval is formed: Student-t, or a BCa bootstrap as a check."""
FINISH_RULE_CHOICES = ("fraction", "zero", "either")
"""When a monitor check counts as settled for `depthdiag recommend` (see analysis/recommend.py):
the mean benefit is below a fraction of the switch's, its interval over batches contains 0, or either."""
DOCUMENT_CHOICES = ("paragraph", "file")
"""What a document of a plain-text file is for `depthdiag prepare` (see trainer/prepare.py)."""
