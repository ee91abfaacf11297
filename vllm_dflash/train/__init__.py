"""Training DFlash drafters: data, target features, packed blocks, the loop and its evaluation."""
