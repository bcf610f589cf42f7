"""Register mfotel in mindformers through mindformers' own `auto_register` route.

Point REGISTER_PATH at this directory (run_mindformer.py: `--register_path`) and name a class
of this file in the first mfotel entry mindformers builds (the train cell is built before the
callbacks):

    runner_wrapper:
      type: CPUTrainOneStepCell
      auto_register: mfotel_register.CPUTrainOneStepCell
    callbacks:
      - type: OTelMonitor
        auto_register: mfotel_register.OTelMonitor

mindformers copies this file into its dynamic-module cache and imports it; `register()`
below registers OTelMonitor and CPUTrainOneStepCell. `mfotel-instrument` needs none of this.
"""
from mfotel.integrations.mindformers import CPUTrainOneStepCell, register
from mfotel.integrations.mindformers import MindFormersOTelMonitor as OTelMonitor

register()

__all__ = ["CPUTrainOneStepCell", "OTelMonitor"]
