"""Device backends: act on the device and the process groups; never decide."""
