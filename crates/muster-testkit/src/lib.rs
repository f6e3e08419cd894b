//! Builders and shared checks for muster's tests.
