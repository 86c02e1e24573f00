"""nn.Modules, one file per family, each with a frozen dataclass config."""
