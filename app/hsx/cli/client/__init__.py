"""The `hsx` client commands (submit, status, jobs, samples, cancel, retry, delete, manifest, download), one
module each, all on the Python SDK (hsx.sdk); common.py holds their shared flags, output and error handling."""
