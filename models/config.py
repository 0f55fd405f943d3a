"""Moved to autoprofile.model_config (the config floor). This name stays an alias of that module only until
the last importer outside the committed tree names the new one; then it goes."""
import sys

from autoprofile import model_config

sys.modules[__name__] = model_config
