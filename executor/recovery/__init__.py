"""After a fault: establish what landed from evidence, then settle or escalate.

``resume`` drives it (classify each in-flight intent, record, retry or
escalate, re-check completed steps); ``evidence`` asks the target (marker,
commit outcome, session liveness, probes); ``load`` reads the cases verified;
``poison`` re-runs the checks of completed steps; ``fence`` keeps a late
attempt's view as evidence.
"""
