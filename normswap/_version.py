"""The package version, in a module of its own: the manifest writer reads it without importing the
package (whose __init__ imports the modules that write manifests)."""

__version__ = "0.1.0"
