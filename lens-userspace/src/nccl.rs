//! NCCL's enums as the ABI defines them (`ncclDataType_t`, `ncclRedOp_t`).
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DataType {
    Int8,
    Uint8,
    Int32,
    Uint32,
    Int64,
    Uint64,
    Float16,
    Float32,
    Float64,
    Bfloat16,
    Float8e4m3,
    Float8e5m2,
}

impl DataType {
    pub fn from_raw(raw: i32) -> Option<DataType> {
        use DataType::*;
        Some(match raw {
            0 => Int8,
            1 => Uint8,
            2 => Int32,
            3 => Uint32,
            4 => Int64,
            5 => Uint64,
            6 => Float16,
            7 => Float32,
            8 => Float64,
            9 => Bfloat16,
            10 => Float8e4m3,
            11 => Float8e5m2,
            _ => return None,
        })
    }

    pub const fn size_bytes(self) -> u64 {
        use DataType::*;
        match self {
            Int8 | Uint8 | Float8e4m3 | Float8e5m2 => 1,
            Float16 | Bfloat16 => 2,
            Int32 | Uint32 | Float32 => 4,
            Int64 | Uint64 | Float64 => 8,
        }
    }

    pub const fn name(self) -> &'static str {
        use DataType::*;
        match self {
            Int8 => "int8",
            Uint8 => "uint8",
            Int32 => "int32",
            Uint32 => "uint32",
            Int64 => "int64",
            Uint64 => "uint64",
            Float16 => "float16",
            Float32 => "float32",
            Float64 => "float64",
            Bfloat16 => "bfloat16",
            Float8e4m3 => "float8e4m3",
            Float8e5m2 => "float8e5m2",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RedOp {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
    /// A user-defined op (`ncclRedOpCreatePreMulSum`), or a value this build does not know.
    Custom(i32),
}

impl RedOp {
    pub fn from_raw(raw: i32) -> Option<RedOp> {
        Some(match raw {
            lens_common::NONE_I32 => return None,
            0 => RedOp::Sum,
            1 => RedOp::Prod,
            2 => RedOp::Max,
            3 => RedOp::Min,
            4 => RedOp::Avg,
            other => RedOp::Custom(other),
        })
    }

    pub fn name(self) -> String {
        match self {
            RedOp::Sum => "sum".into(),
            RedOp::Prod => "prod".into(),
            RedOp::Max => "max".into(),
            RedOp::Min => "min".into(),
            RedOp::Avg => "avg".into(),
            RedOp::Custom(raw) => format!("custom({raw})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_abi_datatype_decodes_with_its_size() {
        let sizes: Vec<u64> = (0..12)
            .map(|raw| DataType::from_raw(raw).unwrap().size_bytes())
            .collect();
        assert_eq!(sizes, [1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1]);
        assert_eq!(DataType::from_raw(12), None);
        assert_eq!(DataType::from_raw(-1), None);
    }

    #[test]
    fn redops_decode_and_unknown_ones_stay_visible() {
        assert_eq!(RedOp::from_raw(4), Some(RedOp::Avg));
        assert_eq!(RedOp::from_raw(-1), None);
        assert_eq!(RedOp::from_raw(9).unwrap().name(), "custom(9)");
    }
}
