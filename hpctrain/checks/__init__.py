"""The login node's checks, run before anything is queued: the config's own rules (config), the cluster's
(cluster, container), the files the run reads (files), those that need the planner's estimates (plan), and the
runner of them all (runner). Each finding names its key and its fix (hpctrain.checks.report.CheckReport)."""
