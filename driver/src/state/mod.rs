//! What the whole node shares, below every part that uses it: the catalog
//! of published devices prepare resolves allocations through, the records
//! of what the node prepared (claims, MIG devices it made) and the durable
//! files that keep them ([`checkpoint`]), and the Events the node writes.
//! Nothing here imports the prepare engine, the kubelet servers or the
//! node's wiring.

pub mod catalog;
pub mod checkpoint;
pub mod events;
pub mod records;
