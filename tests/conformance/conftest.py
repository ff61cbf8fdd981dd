"""The conformance suite runs every registered model that declares a tiny configuration: zoo's
own, the test plugin's (`plugin_model`, registered as a project's plugin would be), and those
of the modules named in `$ZOO_PLUGINS`, so that `ZOO_PLUGINS=my_project.models pytest
tests/conformance` holds a project's models to it too."""

from conformance.checks import load_plugins

load_plugins()
