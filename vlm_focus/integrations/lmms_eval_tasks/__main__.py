"""``python -m vlm_focus.integrations.lmms_eval_tasks`` prints the task folder (for lmms-eval's
``--include_path``)."""

from . import tasks_path

print(tasks_path())
