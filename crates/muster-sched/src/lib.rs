//! muster's scheduling engine.
