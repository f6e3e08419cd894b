//! Hash maps for the pure crates: a fixed, fast hasher instead of the
//! standard library's randomly seeded one, so that nothing depends on a
//! random seed. Use them for lookups only; never iterate one where the order
//! could reach a decision or an output (use a `BTreeMap` there).

use std::hash::{BuildHasherDefault, Hasher};

/// FNV-1a over bytes, a multiply-and-fold for whole integers. Not resistant
/// to chosen keys: for keys the engine or the control plane makes, or names
/// already validated and bounded in number.
#[derive(Debug, Clone, Copy)]
pub struct FixedHasher(u64);

impl Default for FixedHasher {
    fn default() -> Self {
        FixedHasher(0xcbf2_9ce4_8422_2325)
    }
}

impl Hasher for FixedHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.write_u128(u128::from(value));
    }

    fn write_u128(&mut self, value: u128) {
        let folded = ((value as u64) ^ ((value >> 64) as u64).rotate_left(29) ^ self.0)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = folded ^ (folded >> 32);
    }
}

pub type FixedState = BuildHasherDefault<FixedHasher>;

/// A hash map with [`FixedHasher`], for lookups.
pub type LookupMap<K, V> = std::collections::HashMap<K, V, FixedState>; // tidy: allow(fixed hasher)

/// A hash set with [`FixedHasher`], for lookups.
pub type LookupSet<T> = std::collections::HashSet<T, FixedState>; // tidy: allow(fixed hasher)

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_keys_hash_equal_and_lookups_work() {
        let mut map: LookupMap<String, u32> = LookupMap::default();
        for index in 0..1000u32 {
            map.insert(format!("node-{index:05}"), index);
        }
        assert_eq!(map.len(), 1000);
        assert_eq!(map.get("node-00042"), Some(&42));
        let mut wide: LookupMap<u128, u32> = LookupMap::default();
        wide.insert(1 << 100, 1);
        wide.insert(1, 2);
        assert_eq!(wide.get(&(1 << 100)), Some(&1));
        assert_eq!(wide.get(&1), Some(&2));
        assert_eq!(wide.get(&2), None);
    }
}
