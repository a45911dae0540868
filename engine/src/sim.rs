//! KV memory simulator (filled in below).
