//! End-to-end tests for kvgate: real processes (redis-server, gateway, engines) on loopback.
//! The tests live in `tests/tests/`; this library holds their shared harness.
