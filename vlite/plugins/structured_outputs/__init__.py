"""vlite's structured-output backends: ``xgrammar`` (the default) and ``llguidance``."""
