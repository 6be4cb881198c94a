"""The core: the engine and what it stands on."""
