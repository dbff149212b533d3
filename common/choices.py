"""Option choices shared by the engine, the command line and the analysis (no torch here,
so `depthdiag --help` can list them without importing it)."""

ISOLATE_CHOICES = ("counterfactual", "linear", "none")
"""How the diagnostic isolates the batch's effect: Delta(g) - Delta(0), the first-order term, or Delta(g)."""
RMS_MATCH_CHOICES = ("reference", "geomean", "per-tensor", "none")
"""How the compared updates are scaled to a common RMS."""
PRECISION_CHOICES = ("fp32", "bf16")
"""Training precision: fp32, or bf16 autocast."""
EVAL_SET_CHOICES = ("auto", "snapshot", "attributes")
"""The evaluation set `depthdiag diagnose` scores (see diag/driver/run.py)."""
PARALLEL_CHOICES = ("ddp", "fsdp")
"""How torchrun's processes share a training run: replicated weights (DDP) or sharded ones (FSDP2)."""
PLANTED_UNIT_CHOICES = ("slot", "row")
"""What bioS's data.planted_fraction is a share of: bio slots, or whole rows (all their slots planted)."""
DEVICE_CHOICES = ("auto", "cpu", "cuda")
"""Where a command runs: 'auto' (cuda when available, else cpu), 'cpu' or 'cuda'."""
INTERVAL_METHOD_CHOICES = ("t", "bca")
"""How a confidence interval is formed: Student-t, or a BCa bootstrap as a check."""
FINISH_RULE_CHOICES = ("fraction", "zero", "either")
"""When a monitor check counts as settled for `depthdiag recommend` (see analysis/recommend.py):
the mean benefit is below a fraction of the switch's, its interval over batches contains 0, or either."""
DOCUMENT_CHOICES = ("paragraph", "file")
"""What a document of a plain-text file is for `depthdiag prepare` (see trainer/data/prepare.py)."""
RESAMPLES_RANGE = (100, 10**6)
"""Bootstrap resamples a BCa interval may use, inclusive. Below 100 a 95% interval's tails rest on
two or three resamples each (and one resample gives no interval at all); at 10**6 one interval over
64 batches already takes about 1 GB and 2.5 s on one core (scipy draws every resample at once), and
a summary forms dozens of them."""
