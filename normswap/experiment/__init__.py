"""LayerNorm -> RMSNorm comparison experiments: a recipe (TOML) in, a table and a plot out.

    from normswap.experiment import run_experiment
    result = run_experiment("recipes/ln2rms-kjv-gpt2.toml", "runs/kjv", overrides=["finetune.steps=50"])
    result.summary        # one row per arm; result.files: results.json/.csv, summary.md, curves.png
"""

from normswap.experiment.recipe import Recipe, RecipeError, load_recipe, parse_arm, select_arms
from normswap.experiment.runner import ExperimentResult, run_experiment
from normswap.experiment.trainer import Interrupted, StopFlag

__all__ = ["ExperimentResult", "Interrupted", "Recipe", "RecipeError", "StopFlag", "load_recipe", "parse_arm",
           "run_experiment", "select_arms"]
