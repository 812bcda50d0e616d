//! Generates the NRI protocol's Rust code (messages and the ttrpc client and service) from
//! proto/nri/api.proto, lodger's own definitions of the part of NRI it speaks.

fn main() -> std::io::Result<()> {
    println!("cargo:rerun-if-changed=proto/nri/api.proto");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").map_err(std::io::Error::other)?)
        .join("nri");
    std::fs::create_dir_all(&out)?;
    ttrpc_codegen::Codegen::new()
        .out_dir(&out)
        .input("proto/nri/api.proto")
        .include("proto/nri")
        .rust_protobuf()
        .customize(ttrpc_codegen::Customize {
            async_all: true,
            ..Default::default()
        })
        .run()?;
    // `include!` takes items only: the generated files' inner attributes and docs move to the
    // module that includes them (src/api/nri/proto.rs).
    for file in ["api.rs", "api_ttrpc.rs"] {
        let path = out.join(file);
        let text = std::fs::read_to_string(&path)?;
        let kept: String = text
            .lines()
            .filter(|l| !l.starts_with("#![") && !l.starts_with("//!"))
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(&path, kept)?;
    }
    Ok(())
}
