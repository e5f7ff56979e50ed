//! sea-orm entities.
