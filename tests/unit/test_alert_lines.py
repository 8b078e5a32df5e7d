"""A `kind: alert` entry of the run's metrics stream (a task quarantined) as people see it: one `alert:` line in
the launcher's live view and in `omrl follow`, and not repeated by a local job's launcher as a message."""

from services.cli.render import event_line
from services.launcher.local import LocalLauncher
from services.launcher.report import alert_line

ALERT = {
    "kind": "alert",
    "what": "task_quarantined",
    "task": 5,
    "reason": "hung",
    "message": "task 5 quarantined (hung): server http://s:1",
}


def test_an_alert_is_one_line_that_names_the_task_and_the_server():
    line = alert_line(ALERT)
    assert line == "alert: task 5 quarantined (hung): server http://s:1"
    assert event_line({"type": "alert", "data": ALERT}, 10) == line
    assert LocalLauncher._NOISE.search(line), "a local job gets it once, as an alert event"
    assert not LocalLauncher._NOISE.search("env servers: http://s:1 (babyai) ok")
