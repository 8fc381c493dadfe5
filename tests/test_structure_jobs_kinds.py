"""One list of the watchdog's kinds with one label each (issue 20): portal.models.WatchdogKind,
which gpus' Violation.Kind is and from which jobs' verdicts and the notification kinds take theirs."""

from __future__ import annotations

from gpus.models import Violation, WatchdogPolicy
from jobs.watchdog import rules as watchdog
from portal.models import Notification, WatchdogKind


def test_violations_and_their_policies_use_the_one_list():
    assert Violation.Kind is WatchdogKind
    assert Violation._meta.get_field("kind").choices == WatchdogKind.choices
    assert WatchdogPolicy._meta.get_field("kind").choices == WatchdogKind.choices


def test_each_watchdog_kind_is_a_notification_kind_with_the_same_label():
    notification = dict(Notification.Kind.choices)
    for value, label in WatchdogKind.choices:
        assert notification[value] == label


def test_the_watchdogs_verdicts_are_ok_or_one_of_the_kinds():
    assert {k.value for k in watchdog.Kind} == {"ok", *WatchdogKind.values}
