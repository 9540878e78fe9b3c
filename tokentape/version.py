"""The package version, in a module of its own so that the engine (which writes it into every
tape header) need not import the package facade. Kept equal to pyproject.toml's."""

__version__ = "0.1.0"
