//! Empty library target: it lets `redirector` name this crate as a build dependency, so cargo
//! rebuilds the embedded object when the kernel crate changes. The programs are in `main.rs`.
#![no_std]
