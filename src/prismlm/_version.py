"""The package version, in a module of its own so that low layers can record it without importing the
package facade (``prismlm/__init__`` imports the model)."""

__version__ = "0.1.0"
