"""SharpDraft's option names and file name, free of jax so that the CLI parser can list them without importing it
(`longspec --help` stays fast). `longspec_jax.sharpdraft` re-exports them."""

RULES = ("exact", "fixed")
CHOICES = ("off",) + RULES  # the `--sharpdraft` / `load_drafter(sharpdraft=)` values
GRANULARITIES = ("drafter", "layer", "head")
ALPHA_RULES = ("tangent", "fit")
SHARPDRAFT_FILE = "sharpdraft.json"
