"""`snapcompile validate`: an artifact compared step by step with the PyTorch oracle (`parity.py`)."""
