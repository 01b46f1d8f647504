//! The `xtrain` binary: everything is in [`cli`].

mod cli;

fn main() {
    cli::main()
}
