# Bare-metal fleet like inventory.example.ini: two GPU types and three service hosts.
module "fleet" {
  source = "../../"

  ansible_user = "sarv"

  gpu_groups = {
    a100_80g = {
      gpu_model        = "A100-SXM4-80GB"
      gpu_count        = 8
      gpu_memory_mib   = 81920
      gpu_interconnect = "nvlink"
      numa_nodes       = 2
      nic              = "ib0"
      labels           = { tier = "prod", rack = "r1" }
    }
    rtx = {
      gpu_model            = "GeForce RTX 3080"
      gpu_count            = 2
      gpu_memory_mib       = 10240
      gpu_interconnect     = "pcie"
      gpus_per_pcie_switch = 1
      nic                  = "eno1"
      labels               = { tier = "dev" }
    }
  }

  gpu_nodes_vars = {
    nvidia_driver_branch = "550"
    cuda_version         = "12.4"
  }

  hosts = [
    { name = "gpu-a1", address = "10.20.0.11", gpu_group = "a100_80g" },
    { name = "gpu-a2", address = "10.20.0.12", gpu_group = "a100_80g" },
    { name = "gpu-c1", address = "10.20.0.31", gpu_group = "rtx" },
    { name = "svc-1", address = "10.20.0.101", roles = ["redis", "monitoring", "controlplane"] },
    { name = "svc-2", address = "10.20.0.102", roles = ["redis"] },
    { name = "svc-3", address = "10.20.0.103", roles = ["redis"] },
  ]
}
