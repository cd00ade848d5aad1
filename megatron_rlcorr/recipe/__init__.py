"""Recipes: one YAML file per run, parsed into the settings types of every layer and checked
against each other and the launch before any process group exists."""
from .recipe import Recipe, load_recipe, parse_recipe
from .tree import apply_overrides

__all__ = ["Recipe", "apply_overrides", "load_recipe", "parse_recipe"]
