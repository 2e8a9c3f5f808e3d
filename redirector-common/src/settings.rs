//! Typed views of the `u32` settings the maps hold (`ListenerConfig::empty_pool_policy` and
//! `::liveness`, `ListenerMode::mode`), for userspace: each value's mapping to the kernel's
//! constant and to its name in configuration files, metrics and the CLI is written once, here.
//! The programs read the constants (`crate::listener`) and never these enums.

use crate::listener::{
    EMPTY_POOL_FAIL, EMPTY_POOL_PASS, LIVENESS_PROBES, LIVENESS_SOCKETS_AND_PROBES, MODE_AUTO,
    MODE_CACHE, MODE_UPSTREAM,
};

/// A `u32` in a map that is none of its setting's values (written by another build).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct UnknownSetting {
    /// The setting's type name.
    pub setting: &'static str,
    /// The value found.
    pub value: u32,
}

impl core::fmt::Display for UnknownSetting {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{} is not a value of {}", self.value, self.setting)
    }
}

impl core::error::Error for UnknownSetting {}

/// Defines a setting: its variants, each with its kernel constant and its name (which is also
/// its spelling in configuration files).
macro_rules! setting {
    (
        $(#[$meta:meta])*
        $name:ident {
            $($(#[$variant_meta:meta])* $variant:ident = $value:ident, $label:literal;)+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default, serde::Deserialize)]
        pub enum $name {
            $($(#[$variant_meta])* #[serde(rename = $label)] $variant,)+
        }

        impl $name {
            /// Every value.
            pub const ALL: &[Self] = &[$(Self::$variant),+];

            /// The kernel's constant.
            #[must_use]
            pub const fn value(self) -> u32 {
                match self {
                    $(Self::$variant => $value,)+
                }
            }

            /// The name in configuration files, metrics and the CLI.
            #[must_use]
            pub const fn label(self) -> &'static str {
                match self {
                    $(Self::$variant => $label,)+
                }
            }
        }

        impl TryFrom<u32> for $name {
            type Error = UnknownSetting;

            fn try_from(value: u32) -> Result<Self, UnknownSetting> {
                match value {
                    $($value => Ok(Self::$variant),)+
                    _ => Err(UnknownSetting {
                        setting: stringify!($name),
                        value,
                    }),
                }
            }
        }
    };
}

setting! {
    /// What a listener does when its cache is down and its upstream pool is empty.
    EmptyPoolPolicy {
        /// Let DNS through to the listener address untouched.
        #[default]
        Pass = EMPTY_POOL_PASS, "pass";
        /// Fail the client's syscall at once: `EHOSTUNREACH`, or `EPERM` where the kernel's
        /// sock_addr programs lack `bpf_set_retval` (before 6.1).
        Fail = EMPTY_POOL_FAIL, "fail";
    }
}

setting! {
    /// What judges a listener's cache alive.
    Liveness {
        /// Its sockets, counted in the kernel (instant failover on the last close), and probes.
        #[default]
        SocketsAndProbes = LIVENESS_SOCKETS_AND_PROBES, "sockets-and-probes";
        /// Probes only (the cache's sockets are not in `cache_netns`).
        Probes = LIVENESS_PROBES, "probes";
    }
}

setting! {
    /// The operator's override of a listener's route.
    Mode {
        /// Follow the cache's health.
        #[default]
        Auto = MODE_AUTO, "auto";
        /// Always the cache.
        Cache = MODE_CACHE, "cache";
        /// Always the upstream pool.
        Upstream = MODE_UPSTREAM, "upstream";
    }
}

#[cfg(test)]
mod tests {
    use serde::de::{
        DeserializeOwned, IntoDeserializer as _,
        value::{Error, StrDeserializer},
    };

    use super::*;

    /// A setting as a configuration file spells it.
    fn read<T: DeserializeOwned>(text: &'static str) -> Option<T> {
        let deserializer: StrDeserializer<'_, Error> = text.into_deserializer();
        T::deserialize(deserializer).ok()
    }

    #[test]
    fn configuration_files_spell_every_value_by_its_label() {
        for &policy in EmptyPoolPolicy::ALL {
            assert_eq!(read(policy.label()), Some(policy));
        }
        for &liveness in Liveness::ALL {
            assert_eq!(read(liveness.label()), Some(liveness));
        }
        for &mode in Mode::ALL {
            assert_eq!(read(mode.label()), Some(mode));
        }
        assert_eq!(read::<Liveness>("SocketsAndProbes"), None);
    }

    #[test]
    fn every_value_maps_back_and_others_are_refused() {
        for &policy in EmptyPoolPolicy::ALL {
            assert_eq!(EmptyPoolPolicy::try_from(policy.value()), Ok(policy));
        }
        for &liveness in Liveness::ALL {
            assert_eq!(Liveness::try_from(liveness.value()), Ok(liveness));
        }
        for &mode in Mode::ALL {
            assert_eq!(Mode::try_from(mode.value()), Ok(mode));
        }
        assert_eq!(
            Mode::try_from(7),
            Err(UnknownSetting {
                setting: "Mode",
                value: 7
            })
        );
        // The defaults are the zeroed map values.
        assert_eq!(EmptyPoolPolicy::default().value(), 0);
        assert_eq!(Liveness::default().value(), 0);
        assert_eq!(Mode::default().value(), 0);
    }
}
