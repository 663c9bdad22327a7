"""Model implementations (the Llama family) and the built-in tiny test model."""
