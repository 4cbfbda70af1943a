"""Serving inside SGLang: the launcher, plugin registration, the settings FarSkip refuses, each
rank's status report, key redaction, peer timeouts and the deployment's hang watchdog."""
