"""Ready-made target/drafter pairs built from local files (no model hub)."""
