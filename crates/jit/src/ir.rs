//! IR helpers.
