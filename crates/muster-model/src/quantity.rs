//! Quantities as newtypes, so a CPU amount can never be added to a GPU share.

use std::fmt;
use std::ops::{Add, AddAssign, Sub, SubAssign};

macro_rules! quantity {
    ($(#[$meta:meta])* $name:ident($inner:ty), $unit:literal) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        pub struct $name(pub $inner);

        impl $name {
            pub const ZERO: Self = Self(0);

            /// Subtraction that stops at zero.
            pub fn saturating_sub(self, other: Self) -> Self {
                Self(self.0.saturating_sub(other.0))
            }

            /// Subtraction that refuses to go below zero.
            pub fn checked_sub(self, other: Self) -> Option<Self> {
                self.0.checked_sub(other.0).map(Self)
            }
        }

        impl Add for $name {
            type Output = Self;
            fn add(self, other: Self) -> Self {
                Self(self.0 + other.0)
            }
        }

        impl AddAssign for $name {
            fn add_assign(&mut self, other: Self) {
                self.0 += other.0;
            }
        }

        impl Sub for $name {
            type Output = Self;
            fn sub(self, other: Self) -> Self {
                Self(self.0 - other.0)
            }
        }

        impl SubAssign for $name {
            fn sub_assign(&mut self, other: Self) {
                self.0 -= other.0;
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}{}", self.0, $unit)
            }
        }
    };
}

quantity!(
    /// Thousandths of one GPU: 1000 is a whole GPU, 250 a quarter of one.
    GpuMilli(u32),
    "m GPU"
);
quantity!(
    /// Thousandths of one CPU core.
    CpuMilli(u64),
    "m CPU"
);
quantity!(
    /// Memory in MiB.
    MemoryMib(u64),
    " MiB"
);

impl GpuMilli {
    pub const WHOLE: GpuMilli = GpuMilli(1000);

    /// Whole GPUs as thousandths.
    pub fn whole(count: u32) -> Self {
        GpuMilli(count * 1000)
    }
}

/// A point in time: milliseconds since the Unix epoch (or since the start of a
/// simulation). Pure code receives it as a parameter and never reads a clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Time(pub u64);

impl Time {
    pub fn from_secs(secs: u64) -> Self {
        Time(secs * 1000)
    }

    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1000.0
    }

    /// Milliseconds from `earlier` to `self`, zero if `earlier` is later.
    pub fn millis_since(self, earlier: Time) -> u64 {
        self.0.saturating_sub(earlier.0)
    }

    pub fn plus_millis(self, millis: u64) -> Time {
        Time(self.0.saturating_add(millis))
    }
}

/// What one task asks of GPUs: a number of whole GPUs (zero for a CPU-only
/// task), or a share of exactly one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GpuRequest {
    Whole(u32),
    /// A share of one GPU, 1..=999 thousandths.
    Shared(GpuMilli),
}

impl GpuRequest {
    /// Total GPU capacity asked, in thousandths.
    pub fn total(self) -> GpuMilli {
        match self {
            GpuRequest::Whole(count) => GpuMilli::whole(count),
            GpuRequest::Shared(share) => share,
        }
    }

    /// How many distinct GPUs the task occupies.
    pub fn gpu_count(self) -> u32 {
        match self {
            GpuRequest::Whole(count) => count,
            GpuRequest::Shared(_) => 1,
        }
    }

    /// What the task needs free on each GPU it uses.
    pub fn per_gpu(self) -> GpuMilli {
        match self {
            GpuRequest::Whole(_) => GpuMilli::WHOLE,
            GpuRequest::Shared(share) => share,
        }
    }

    /// Builds a request from a count and a per-GPU share, as traces give them.
    /// `None` when the pair is not meaningful (a share above one GPU, or a
    /// share of several GPUs).
    pub fn from_count_and_share(count: u32, per_gpu_milli: u32) -> Option<Self> {
        match (count, per_gpu_milli) {
            (0, _) => Some(GpuRequest::Whole(0)),
            (_, 1000) => Some(GpuRequest::Whole(count)),
            (1, 1..=999) => Some(GpuRequest::Shared(GpuMilli(per_gpu_milli))),
            _ => None,
        }
    }
}

impl fmt::Display for GpuRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuRequest::Whole(count) => write!(f, "{count} GPU"),
            GpuRequest::Shared(share) => write!(f, "{:.3} GPU", share.0 as f64 / 1000.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_request_totals() {
        assert_eq!(GpuRequest::Whole(3).total(), GpuMilli(3000));
        assert_eq!(GpuRequest::Shared(GpuMilli(250)).total(), GpuMilli(250));
        assert_eq!(GpuRequest::Shared(GpuMilli(250)).gpu_count(), 1);
        assert_eq!(GpuRequest::Whole(0).gpu_count(), 0);
    }

    #[test]
    fn from_count_and_share_rejects_shares_of_several_gpus() {
        assert_eq!(
            GpuRequest::from_count_and_share(2, 500),
            None,
            "a share is of one GPU only"
        );
        assert_eq!(
            GpuRequest::from_count_and_share(1, 460),
            Some(GpuRequest::Shared(GpuMilli(460)))
        );
        assert_eq!(
            GpuRequest::from_count_and_share(4, 1000),
            Some(GpuRequest::Whole(4))
        );
        assert_eq!(GpuRequest::from_count_and_share(1, 1001), None);
    }
}
